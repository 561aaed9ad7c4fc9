"""Program.digest: equal for equal programs however they were made, different otherwise."""

import pickle

import nereus
from nereus.backend.lower import lower
from nereus.testing.cases import case_module


def test_the_digest_depends_on_the_program_alone():
    m = nereus.run_pipeline(case_module("tp4-tp2x2", 4, hidden=64, layers=4), "plan-transition{to=@b,into=@t}")
    here = lower(m, "t")
    elsewhere = lower(pickle.loads(pickle.dumps(m)), "t")  # as a rank that received the module
    travelled = pickle.loads(pickle.dumps(here))  # a program sent to another process
    assert here.digest() == elsewhere.digest() == travelled.digest()
    assert lower(m, "t", bucket_bytes=4096).digest() != here.digest()
