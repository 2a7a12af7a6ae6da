import sys

from omnidesk.gui.app import main

sys.exit(main())
