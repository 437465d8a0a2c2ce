"""`python -m odbd.simulate ...` runs `odbd simulate` standalone."""

import sys

from odbd.simulate.command import main

sys.exit(main())
