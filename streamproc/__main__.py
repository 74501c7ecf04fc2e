from streamproc.cli import main

main()
