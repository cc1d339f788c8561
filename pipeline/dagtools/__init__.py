"""Tools about the DAG itself, not stages of it: derive it, compare it, rebuild it, plan it across hosts.
No stage imports this package (a change here reruns nothing).

    catalog.py    the stages the project declares, found by name under pipeline/stages/
    dag.py        `kiln dag`: dvc.yaml derived from the declarations and params.yaml (each stage's code closure)
    lockdiff.py   a rebuild's dvc.lock against the committed one, stage by stage, classified
    rebuild.py    `kiln rebuild-check`: rebuild one stage in a fresh process and scratch project, classify the bytes
    plan.py       `kiln plan`: which engines each hardware family builds (the CI build matrix)
    profiles.py   `kiln profile`: named overlays merged into params.yaml
"""
