"""hybridflow.workers"""
