"""Operations: the run ledger, crash safety and the stage functions submitted to Dask."""
