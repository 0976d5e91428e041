#!/bin/bash
grep -cx "$TARGET_WORD" /app/data/words.txt > /app/count.txt
