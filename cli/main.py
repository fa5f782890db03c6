def main():
    print("csrun")
