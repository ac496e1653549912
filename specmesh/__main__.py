import os
import sys

try:
    from specmesh_app.cli import main
except KeyboardInterrupt:  # Ctrl-C before the command line is even read: answered as main answers it
    print("specmesh: interrupted", file=sys.stderr)
    os._exit(130)

sys.exit(main())
