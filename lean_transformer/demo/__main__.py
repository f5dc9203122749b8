import sys

from lean_transformer.demo.local_swarm import main

sys.exit(main())
