"""Bounds on what can stall a run:

- :mod:`.user_calls`: time bounds on every call into user code (reward functions, judges, ``rollout_func``, tools,
  environments);
- :mod:`.watchdog`: the stall watchdog, which says where a run stopped moving;
- :mod:`.process_group`: processes that agree on stopping (a flag or-ed over every process).
"""
