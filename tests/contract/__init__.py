"""The contract every framework keeps, written once (:mod:`tests.contract.table`)."""
