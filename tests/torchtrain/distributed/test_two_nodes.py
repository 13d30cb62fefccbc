"""Two "nodes" on one machine: two real launcher processes (node_rank 0 and 1) of one CPU process each join one
job over loopback; each launcher's fit_distributed must return the trained model, with DDP and with FSDP."""
import textwrap

import pytest
import torch

from tests.torchtrain.distributed.support import (
    assert_state_dicts_equal, free_port, make_model, run_scripts_together)

TWO_NODE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from tests.torchtrain.distributed.support import make_train_loop

    if __name__ == "__main__":
        node_rank, port, out, gpu_mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
        tl = make_train_loop(gpu_mode=gpu_mode)
        model = tl.fit_distributed(num_epochs=2, num_nodes=2, node_rank=node_rank, master_addr="127.0.0.1",
                                   master_port=port, num_cpu_processes=1, start_method="fork")
        torch.save({"state_dict": model.state_dict(), "history": dict(tl.train_history), "epoch": tl.epoch}, out)
""")


def run_two_nodes(tmp_path, gpu_mode: str) -> list:
    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODE_SCRIPT)
    port = str(free_port())
    run_scripts_together([[script, node, port, tmp_path / f"node{node}.pt", gpu_mode] for node in (0, 1)],
                         [None, None])
    return [torch.load(tmp_path / f"node{node}.pt", weights_only=False) for node in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("gpu_mode", [pytest.param("fsdp", marks=pytest.mark.extended), "ddp"])
def test_every_nodes_launcher_returns_the_trained_model(tmp_path, gpu_mode):
    """Under FSDP the whole state is gathered on global rank 0 only: node 1's launcher gets it too."""
    node0, node1 = run_two_nodes(tmp_path, gpu_mode)
    assert_state_dicts_equal(node0["state_dict"], node1["state_dict"])
    assert not torch.equal(node0["state_dict"]["out.weight"], make_model().state_dict()["out.weight"])
    assert node0["epoch"] == node1["epoch"] == 1
    assert node0["history"] == node1["history"]
