from treadle.cli import main

main()
