import sys

from lean_transformer.swarm.auth.cli import main

sys.exit(main())
