"""The mathematics behind the accountants (no state): RDP, GDP, PRV and PLD analyses."""
