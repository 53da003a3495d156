from improved.cli import main

raise SystemExit(main())
