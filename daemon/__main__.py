from skilltrain.cli import main

main()
