from hylora.cli import main

main()
