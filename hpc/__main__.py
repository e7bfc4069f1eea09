from hpc.cli import main

raise SystemExit(main())
