import sys

from specmesh.app.cli import main

sys.exit(main())
