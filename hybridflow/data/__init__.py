"""hybridflow.data"""
