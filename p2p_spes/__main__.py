import sys

from p2p_spes.cli import main

sys.exit(main())
