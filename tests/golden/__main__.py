from tests.golden import write_all

write_all()
