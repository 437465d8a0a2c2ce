import sys

from odbd.cli import main

sys.exit(main())
