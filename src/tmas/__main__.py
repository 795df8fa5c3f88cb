from tmas.cli.main import main

main()
