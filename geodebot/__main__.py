from geodebot.cli.main import main

raise SystemExit(main())
