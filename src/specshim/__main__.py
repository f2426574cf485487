from specshim.cli import main

raise SystemExit(main())
