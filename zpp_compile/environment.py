"""The environment variables zeropp reads, in a module of their own: the `zeropp` command names them
in its help without loading torch."""

DUMP_DIR_ENV = "ZEROPP_DUMP_DIR"  # Config.dump_dir for every model (`zeropp dump` sets it)
DISABLE_PASSES_ENV = "ZEROPP_DISABLE_PASSES"  # Config.disable_passes for every model, comma-separated
