import sys

from tandem.services.launcher import main

sys.exit(main())
