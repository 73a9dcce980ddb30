"""``python -m grpokit.pipeline.workers``: a rollout worker process (:mod:`grpokit.pipeline.workers.child`)."""

import sys

from .child import main

sys.exit(main())
