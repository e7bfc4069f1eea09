from hpc_dev.cli import main

raise SystemExit(main())
