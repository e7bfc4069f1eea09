from hpc_dev.dev_cli import main

raise SystemExit(main())
