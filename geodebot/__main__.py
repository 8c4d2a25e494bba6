from geodebot.cli import main

raise SystemExit(main())
