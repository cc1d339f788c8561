"""What the build shows people: tables and pages made from the DAG's records.

    page.py          `kiln report`: the HTML page (engines, systems, releases, peers) from the records alone
    systems.py       the page's system sections: system@ gates, sysbench@ load curves, the peer table
    leaderboard.py   the leaderboard's rows (leaderboard@: every engine's accuracy and speed on this host class)
    fallbacks.py     the fallback table's rows (fallback-table@: which ops run outside a target's native kernels)
"""
