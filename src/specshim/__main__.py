from specshim.cli import main

# vLLM spawns its workers; a spawned child re-imports this module as
# __mp_main__, which must not run the command again.
if __name__ == "__main__":
    raise SystemExit(main())
