from tmas.cli.entry import main

main()
