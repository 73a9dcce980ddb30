"""``coding``: write a small Python function; the reply's last fenced python block is run against the row's tests in
a sandbox (:class:`grpokit.rewards.CodeExecution`)."""

from __future__ import annotations

import random
import string

from ..rewards import CodeExecution
from .base import Task, split_holdout, user_turn

__all__ = ["coding_problems", "make_coding_task"]

INSTRUCTION = "Reply with the function in a ```python code block."

DESCRIPTION = (
    "Coding: \"Write a Python function `name(args)` that ...\" for 12 families of small functions (add or multiply "
    "by a constant, count a letter, keep every k-th item, ...) with their constants varied, and 12 classics "
    "(factorial, gcd, palindromes, ...): 275 problems with 2 to 4 assert tests each, shuffled by the seed, the first "
    "n_eval held out. The reply's last fenced python block runs against the row's tests in a sandbox; the reward "
    "code_execution is the share of tests passed, and a reply is right (the accuracy) when every test passes."
)

_CLASSICS = [
    ("factorial(n)", "returns n! for n >= 0", "import math\ndef factorial(n):\n    return math.factorial(n)",
     ["assert factorial(0) == 1", "assert factorial(5) == 120", "assert factorial(10) == 3628800"]),
    ("fib(n)", "returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(20) == 6765"]),
    ("gcd(a, b)", "returns the greatest common divisor of two positive integers",
     "import math\ndef gcd(a, b):\n    return math.gcd(a, b)",
     ["assert gcd(12, 18) == 6", "assert gcd(7, 13) == 1", "assert gcd(100, 75) == 25"]),
    ("is_palindrome(s)", "returns True when the string s reads the same backwards, else False",
     "def is_palindrome(s):\n    return s == s[::-1]",
     ["assert is_palindrome('level') is True", "assert is_palindrome('abc') is False", "assert is_palindrome('') is True"]),
    ("count_vowels(s)", "returns how many of the characters of s are one of a, e, i, o, u (lower case)",
     "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
     ["assert count_vowels('banana') == 3", "assert count_vowels('xyz') == 0", "assert count_vowels('aeiou') == 5"]),
    ("reverse_words(s)", "returns the words of s (separated by single spaces) in reverse order, joined by spaces",
     "def reverse_words(s):\n    return ' '.join(s.split(' ')[::-1])",
     ["assert reverse_words('a b c') == 'c b a'", "assert reverse_words('hello') == 'hello'",
      "assert reverse_words('one two') == 'two one'"]),
    ("second_largest(xs)", "returns the second largest distinct number of the list xs (it has at least two)",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]",
     ["assert second_largest([1, 2, 3]) == 2", "assert second_largest([5, 5, 4]) == 4",
      "assert second_largest([-1, -7, 0]) == -1"]),
    ("flatten(xss)", "returns one list of the items of the lists in xss, in order",
     "def flatten(xss):\n    return [x for xs in xss for x in xs]",
     ["assert flatten([[1, 2], [3]]) == [1, 2, 3]", "assert flatten([]) == []", "assert flatten([[], [4]]) == [4]"]),
    ("unique_sorted(xs)", "returns the distinct items of xs in increasing order",
     "def unique_sorted(xs):\n    return sorted(set(xs))",
     ["assert unique_sorted([3, 1, 3, 2]) == [1, 2, 3]", "assert unique_sorted([]) == []",
      "assert unique_sorted([5]) == [5]"]),
    ("sum_digits(n)", "returns the sum of the decimal digits of the non-negative integer n",
     "def sum_digits(n):\n    return sum(int(d) for d in str(n))",
     ["assert sum_digits(0) == 0", "assert sum_digits(123) == 6", "assert sum_digits(9999) == 36"]),
    ("is_prime(n)", "returns True when the integer n is a prime number, else False",
     "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
     ["assert is_prime(2) is True", "assert is_prime(1) is False", "assert is_prime(97) is True",
      "assert is_prime(91) is False"]),
    ("max_of(xs)", "returns the largest number of the non-empty list xs without using max()",
     "def max_of(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n            best = x\n    return best",
     ["assert max_of([3, 9, 2]) == 9", "assert max_of([-5]) == -5", "assert max_of([-2, -1, -3]) == -1"]),
]


def _families() -> list[tuple[str, str, str, list[str]]]:
    """(signature, what it returns, a reference solution, tests) for every constant of every family."""
    out = []
    for k in range(1, 51):
        out.append((f"plus_{k}(x)", f"returns x + {k}", f"def plus_{k}(x):\n    return x + {k}",
                    [f"assert plus_{k}(0) == {k}", f"assert plus_{k}(5) == {5 + k}", f"assert plus_{k}(-3) == {k - 3}"]))
    for k in range(2, 41):
        out.append((f"times_{k}(x)", f"returns x multiplied by {k}", f"def times_{k}(x):\n    return x * {k}",
                    [f"assert times_{k}(0) == 0", f"assert times_{k}(3) == {3 * k}", f"assert times_{k}(-2) == {-2 * k}"]))
    for k in range(2, 7):
        out.append((f"power_{k}(x)", f"returns x to the power {k}", f"def power_{k}(x):\n    return x ** {k}",
                    [f"assert power_{k}(2) == {2 ** k}", f"assert power_{k}(-1) == {(-1) ** k}",
                     f"assert power_{k}(3) == {3 ** k}"]))
    for k in range(2, 21):
        ref = f"def sum_multiples_{k}(n):\n    return sum(range(0, n, {k}))"
        out.append((f"sum_multiples_{k}(n)", f"returns the sum of the non-negative multiples of {k} below n", ref,
                    [f"assert sum_multiples_{k}({n}) == {sum(range(0, n, k))}" for n in (0, 10, 50)]))
    for c in string.ascii_lowercase:
        ref = f"def count_{c}(s):\n    return s.count('{c}')"
        out.append((f"count_{c}(s)", f"returns how many times the letter '{c}' occurs in the string s", ref,
                    [f"assert count_{c}('') == 0", f"assert count_{c}('{c}-{c}') == 2", f"assert count_{c}('{c * 5}') == 5"]))
        ref = f"def starting_with_{c}(words):\n    return [w for w in words if w.startswith('{c}')]"
        words = [f"{c}pple", "zz", f"{c}", "q"] if c not in "zq" else [f"{c}pple", "mm", f"{c}", "b"]
        out.append((f"starting_with_{c}(words)", f"returns the words of the list words that start with '{c}', in order",
                    ref, [f"assert starting_with_{c}([]) == []",
                          f"assert starting_with_{c}({words!r}) == {[w for w in words if w.startswith(c)]!r}"]))
    for k in range(2, 31):
        out.append((f"divisible_by_{k}(n)", f"returns True when the integer n is divisible by {k}, else False",
                    f"def divisible_by_{k}(n):\n    return n % {k} == 0",
                    [f"assert divisible_by_{k}(0) is True", f"assert divisible_by_{k}({3 * k}) is True",
                     f"assert divisible_by_{k}({3 * k + 1}) is False"]))
        out.append((f"floor_to_{k}(x)", f"returns the largest multiple of {k} that is not greater than the integer x",
                    f"def floor_to_{k}(x):\n    return x - x % {k}",
                    [f"assert floor_to_{k}({k}) == {k}", f"assert floor_to_{k}({2 * k + 1}) == {2 * k}",
                     f"assert floor_to_{k}(-1) == {-k}"]))
    for k in range(2, 21):
        out.append((f"scale_{k}(xs)", f"returns a new list with every number of the list xs multiplied by {k}",
                    f"def scale_{k}(xs):\n    return [x * {k} for x in xs]",
                    [f"assert scale_{k}([]) == []", f"assert scale_{k}([1, -2]) == [{k}, {-2 * k}]"]))
    for k in range(2, 10):
        out.append((f"repeat_{k}(s)", f"returns the string s repeated {k} times", f"def repeat_{k}(s):\n    return s * {k}",
                    [f"assert repeat_{k}('ab') == {'ab' * k!r}", f"assert repeat_{k}('') == ''"]))
        out.append((f"last_{k}(xs)", f"returns the last {k} items of the list xs (all of them when it is shorter)",
                    f"def last_{k}(xs):\n    return xs[-{k}:]",
                    [f"assert last_{k}(list(range(20))) == {list(range(20))[-k:]!r}", f"assert last_{k}([1]) == [1]",
                     f"assert last_{k}([]) == []"]))
    for k in range(2, 7):
        out.append((f"every_{k}th(xs)", f"returns every {k}-th item of the list xs, starting with the first",
                    f"def every_{k}th(xs):\n    return xs[::{k}]",
                    [f"assert every_{k}th(list(range(12))) == {list(range(12))[::k]!r}", f"assert every_{k}th([]) == []"]))
    return out


def coding_problems() -> list[dict]:
    """Every problem as a row: ``prompt``, ``tests`` (assert statements), ``solution`` (a reference that passes them)
    and ``function``, in a fixed order before shuffling."""
    rows = []
    for signature, returns, solution, tests in _families() + _CLASSICS:
        prompt = f"Write a Python function `{signature}` that {returns}. {INSTRUCTION}"
        rows.append({"prompt": user_turn(prompt), "tests": tests, "solution": solution,
                     "function": signature.split("(")[0]})
    return rows


def make_coding_task(*, seed: int = 0, n_eval: int = 128, timeout_s: float = 5.0) -> Task:
    """The task; ``timeout_s``: the sandbox's wall-clock limit per reply."""
    rows = coding_problems()
    random.Random(seed).shuffle(rows)
    train, held_out = split_holdout(rows, n_eval, "coding")
    return Task(
        name="coding",
        train_dataset=train,
        eval_dataset=held_out,
        reward_funcs=[CodeExecution(name="code_execution", timeout_s=timeout_s)],
        accuracy_reward="code_execution",
        description=DESCRIPTION,
        metadata={"seed": seed, "n_eval": n_eval, "n_prompts": len(rows)},
    )
