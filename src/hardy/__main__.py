from hardy.cli.main import main

raise SystemExit(main())
