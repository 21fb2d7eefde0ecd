from service.main import exit_now, main

exit_now(main())
