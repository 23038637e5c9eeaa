from ftflow.cli import main

main()
