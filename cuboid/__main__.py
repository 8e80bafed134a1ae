import sys

from cuboid.cli import main

sys.exit(main())
