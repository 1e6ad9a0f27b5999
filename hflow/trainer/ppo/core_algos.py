"""`hflow.trainer.ppo.core_algos` is `hflow.algorithms.core_algos` (the verl-style import path).

The math lives below the workers so that actor, critic and trainer all import it downwards; this alias
keeps `from hflow.trainer.ppo import core_algos` working and shares one module object (one registry).
"""

import sys

from hflow.algorithms import core_algos as _core_algos

sys.modules[__name__] = _core_algos
