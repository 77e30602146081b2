from attnbench.cli import main

raise SystemExit(main())
