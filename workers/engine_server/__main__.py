from workers.engine_server.app import main

main()
