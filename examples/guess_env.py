"""An environment for `grpokit train examples/guess.yaml`: guess a secret number with "higher"/"lower" hints.

TRL 1.16's environment interface: ``reset(**row)`` starts an episode from a dataset row (a string it returns is
appended to the prompt), every other public method is a tool the model may call, and ``get_reward()`` scores the
episode. grpokit gives every rollout an instance of its own.
"""


class GuessNumber:
    def reset(self, **row):
        self.secret = int(row["answer"])
        self.guesses = 0
        self.found = False
        return None

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: your guess, from 1 to 100
        """
        self.guesses += 1
        if int(number) == self.secret:
            self.found = True
            return "correct"
        return "higher" if int(number) < self.secret else "lower"

    def get_reward(self) -> float:
        """1 for finding the number, less for each extra guess; 0 when it was never found."""
        return max(0.0, 1.0 - 0.1 * (self.guesses - 1)) if self.found else 0.0
