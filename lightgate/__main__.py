from lightgate.cli import main

main()
