import pytest

from odbd.cli import apply_environment, config_from_args, daemon_parser
from odbd.config import node_rank_from_environment
from odbd.errors import ConfigError


def parse(argv, environ):
    parser = daemon_parser()
    apply_environment(parser, environ)
    return config_from_args(parser.parse_args(argv))


def test_every_flag_reads_its_odbd_variable():
    config = parse(
        ["--dataset-size", "10"],
        {"ODBD_WORLD": "16", "ODBD_NPROC_PER_NODE": "8", "ODBD_NODE_RANK": "1",
         "ODBD_PEERS": "a:1,b:2", "ODBD_JOIN": "false", "ODBD_SHM_SIZE": "512M",
         "ODBD_PAD": "input_ids=7"},
    )  # fmt: skip
    assert config.world.world_size == 16 and config.world.ranks_per_node == 8
    assert config.node_rank == 1 and config.peers == ("a:1", "b:2")
    assert config.join is False and config.shm_size == 512 << 20
    assert dict(config.pads)["input_ids"] == 7.0


def test_the_command_line_wins_over_the_environment():
    config = parse(
        ["--world", "4", "--nproc-per-node", "2", "--dataset-size", "3", "--peers", "x:1,y:2"],
        {"ODBD_WORLD": "16", "ODBD_NPROC_PER_NODE": "8"},
    )
    assert config.world.world_size == 4


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="ODBD_WORLD='many'"):
        parse(["--dataset-size", "1"], {"ODBD_WORLD": "many", "ODBD_NPROC_PER_NODE": "1"})


@pytest.mark.parametrize(
    ("environ", "rank"),
    [
        ({"NODE_RANK": "3"}, 3),
        ({"GROUP_RANK": "2"}, 2),
        ({"JOB_COMPLETION_INDEX": "5"}, 5),
        ({"HOSTNAME": "train-odbd-7"}, 7),
        ({}, 0),
    ],
)
def test_node_rank_defaults_like_torchrun_and_kubernetes(environ, rank):
    assert node_rank_from_environment(environ) == rank
