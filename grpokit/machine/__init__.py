"""What the machine offers and how a run uses it:

- :mod:`.threads`: torch's CPU thread count fitted to the cores that are actually free;
- :mod:`.cpu_features`: what this CPU computes natively and fast (for the demo's dtype);
- :mod:`.reproducible`: runs of one seed that take the same steps on a CPU with several threads.
"""
