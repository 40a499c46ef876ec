"""``python -m bigbatch.cli`` (and ``torchrun -m bigbatch.cli train``): the ``bigbatch``
command."""

from . import main

raise SystemExit(main())
