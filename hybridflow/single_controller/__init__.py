"""hybridflow.single_controller"""
