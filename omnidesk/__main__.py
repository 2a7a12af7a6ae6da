from omnidesk.cli import main
import sys
sys.exit(main())
