from streamproc.cli import main

if __name__ == "__main__":  # spawned decode processes import this module too
    main()
