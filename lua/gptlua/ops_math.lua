-- placeholder removed below
return {}
