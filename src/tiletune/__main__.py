from tiletune.cli import main

main()
