"""One module per DAG stage: a pure core (`run`), its DVC declaration (`STAGE`) and a thin CLI (`main`)."""
