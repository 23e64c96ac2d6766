"""`python -m hardy`: the command line, and how torchrun starts `--tp` workers."""
import sys

from hardy import fast_exit
from hardy.cli.main import main
from hardy.fast_exit import exit_now

code = main()
distributed = sys.modules.get("hardy.parallel.distributed")
# Skip interpreter finalization where nothing is left to finalize: a launcher or launched worker whose work
# is done, and a worker that met its peers and destroyed its process group (the model's row-parallel layers
# still hold the gloo group, and its threads torn down at finalization aborted a worker now and then:
# 'terminate called without an active exception', pytorch/pytorch#179291).
if fast_exit.requested() or (distributed is not None and distributed.left_together()):
    exit_now(code)
raise SystemExit(code)
